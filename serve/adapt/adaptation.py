"""The server's side of online adaptation: capture each finished request (with the client that sent it), swap in
the head versions the trainer publishes (between requests, without a restart), and roll a version back when the
trainer's paired verdict on the requests it served says it did worse than the one it replaced. A version descended
from one rolled back is never swapped in.

Everything here runs in the engine thread between requests, or in the capture store's writer thread; the head
only drafts, so whatever version serves, the output is the target's.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from draftsmith.heads.kinds import DraftShape
from draftsmith.serve.adapt.capture import Captured, CaptureObserver
from draftsmith.serve.adapt.config import AdaptConfig
from draftsmith.serve.adapt.judge import LiveTally
from draftsmith.serve.adapt.store import CaptureStore
from draftsmith.serve.adapt.trainer_process import TrainerProcess
from draftsmith.serve.adapt.verdict import Verdict
from draftsmith.serve.adapt.versions import LiveRecord, Workspace, salt_fingerprint, version_name, version_number
from draftsmith.serve.build import engine_salt, make_proposer, resolve_shape
from draftsmith.serve.engine.engine import Engine
from draftsmith.serve.engine.generation import Generation
from draftsmith.serve.engine.observer import Observer, Observers
from draftsmith.serve.models.target import LoadedTarget, TargetConfig
from draftsmith.serve.spec import SpecConfig

log = logging.getLogger("draftsmith.serve.adapt")


class TallyObserver(Observer):
    """Counts a finished request toward the live tau of the version that served it."""

    def __init__(self, adaptation: Adaptation, version: str) -> None:
        self.adaptation, self.version = adaptation, version

    def finish(self, generation: Generation) -> None:
        m = generation.metrics
        self.adaptation.tally.served(self.version, m.accepted_tokens, m.drafts)


class Adaptation:
    def __init__(
        self, cfg: AdaptConfig, target: LoadedTarget, target_cfg: TargetConfig, spec: SpecConfig, engine: Engine
    ) -> None:
        if engine.proposer is None or not engine.target_layers or not spec.drafter:
            raise ValueError(
                f"adapt=true adapts a trained drafter that reads the target's features (e.g. spec=eagle3 "
                f"spec.drafter=DIR); spec={spec.name} has none"
            )
        self.cfg, self.target, self.spec, self.engine = cfg, target, spec, engine
        self.ws = Workspace(Path(cfg.dir).expanduser())
        served = resolve_shape(spec)
        shape = DraftShape(served.num_tokens, served.tree.topk, served.tree.total_tokens, served.choices)
        self.ws.start(Path(spec.drafter), asdict(shape))
        self.record = LiveRecord.read(self.ws) or LiveRecord(live=version_name(0))
        if not (self.ws.folder(self.record.live) / "config.json").is_file():
            log.warning("live.json names %s, which is gone: serving v0000", self.record.live)
            self.record.live, self.record.previous = version_name(0), None
        self.tally = LiveTally()
        self.served_version = version_name(0)  # the version the engine drafts with: v0000 is spec.drafter's copy
        self.swap_to(self.record.live)
        cap = int(cfg.capture_gb * 2**30)
        self.client_salt = self.ws.client_salt()  # keys the client ids the store records (serve/http/client.py)
        self.store = CaptureStore(
            self.ws.capture,
            target.target_id,
            engine.target_layers,
            cap,
            client_cap=cfg.client_cap,
            client_ids=salt_fingerprint(self.client_salt),
        )
        settings = {"target": asdict(target_cfg), "drafter": str(self.ws.folder(version_name(0)))}
        self.trainer = TrainerProcess(self.ws, settings | {"options": asdict(cfg)}) if cfg.trainer else None

    def observer(self, prompt_ids: list[int], client: str = "local") -> Observer:
        """What watches one request: its capture (under its client: serve/http/client.py), and the live tally of
        the version serving it."""
        live = self.record.live
        return Observers(CaptureObserver(prompt_ids, live, self.captured, client), TallyObserver(self, live))

    def captured(self, c: Captured) -> None:
        self.store.add(c)

    def between_requests(self) -> None:
        """Roll the live version back if the trainer's verdict says so; else take a newer published version whose
        line holds no rolled-back version."""
        r = self.record
        verdict = Verdict.read(self.ws, r.live) if r.previous is not None else None
        if verdict is not None and verdict.roll_back and verdict.against == r.previous:
            why = f"on the {verdict.requests} requests it served, its tau was {verdict.gain:+.4f} from the last head's"
            log.warning("head %s rolled back to %s: %s", r.live, r.previous, why)
            r.rejected.append(r.live)
            self.go_live(r.previous, previous=None)
            return
        self.save_record()
        latest = self.ws.latest()
        if latest and version_number(latest) > version_number(r.live) and not self.ws.tainted(latest, r.rejected):
            self.go_live(latest, previous=r.live)

    def go_live(self, version: str, previous: str | None) -> None:
        try:
            self.swap_to(version)
        except Exception as e:  # a version that does not load is passed over; the live one serves on
            log.warning("head %s not swapped in (%s: %s); serving %s", version, type(e).__name__, e, self.record.live)
            self.record.rejected.append(version)
        else:
            self.record.live, self.record.previous = version, previous
        self.save_record()

    def swap_to(self, version: str) -> None:
        if version == self.served_version:
            return
        spec = resolve_shape(replace(self.spec, drafter=str(self.ws.folder(version))))
        proposer = make_proposer(spec, self.target)
        assert proposer is not None, "a spec with a drafter has a proposer"
        self.engine.replace_proposer(proposer, engine_salt(self.target, spec))
        self.served_version = version
        log.info("head %s swapped in", version)

    def save_record(self) -> None:
        self.record.tau = self.tally.summary()
        self.record.write(self.ws)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, registry=registry).set_function(read)

        gauge("draftsmith_adapt_head_version", "The head version serving", lambda: version_number(self.record.live))
        gauge("draftsmith_adapt_rollbacks", "Versions rolled back or not loaded", lambda: len(self.record.rejected))
        gauge("draftsmith_adapt_captured_requests", "Requests in the capture store", lambda: len(self.store.shards))
        gauge("draftsmith_adapt_capture_bytes", "Bytes in the capture store", lambda: self.store.bytes)
        gauge("draftsmith_adapt_capture_stopped", "1 once capture stopped (a failed write)", lambda: self.stopped)
        gauge("draftsmith_adapt_trainer_cpu_seconds", "CPU seconds the trainer process used", self.trainer_cpu)

    @property
    def stopped(self) -> float:
        return float(self.store.stopped is not None)

    def trainer_cpu(self) -> float:
        return self.trainer.cpu_seconds() if self.trainer else 0.0

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.stop()
        self.store.close()
        self.save_record()
