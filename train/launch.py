"""`accelerate launch --cpu --num_processes N` starts a single process unless mpirun is set up
(huggingface/accelerate#2741). Spot that case and start the N processes with torch.distributed.run
(gloo), as accelerate's multi-GPU launches do; each of them then joins the process group as usual."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


def requested_cpu_processes() -> int:
    """N when we are the lone process of `accelerate launch --cpu --num_processes N` (N > 1), else 1."""
    env = os.environ
    # accelerate sets MASTER_ADDR only when asked for more than one process
    if env.get("ACCELERATE_USE_CPU", "").lower() != "true" or "MASTER_ADDR" not in env:
        return 1
    if any(v in env for v in RANK_VARS):
        return 1  # already one of several processes
    try:  # the launcher is our parent; its command line says how many processes were asked for
        argv = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return 1
    if "launch" not in argv:
        return 1
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    args, _ = launch_command_parser().parse_known_args(argv[argv.index("launch") + 1 :])
    if args.num_processes is None and args.config_file:  # e.g. conf/accelerate/cpu_ddp.yaml
        args.num_processes = load_config_from_file(args.config_file).num_processes
    return args.num_processes or 1


def relaunch(n: int, module: str) -> int:
    env = os.environ
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={n}",
        f"--master-addr={env['MASTER_ADDR']}",
        f"--master-port={env.get('MASTER_PORT', '29500')}",
        "-m",
        module,
        *sys.argv[1:],
    ]
    return subprocess.call(cmd)
