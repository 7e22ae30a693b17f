"""Online adaptation, the trainer's half: the process beside draftsmith-serve (`python -m draftsmith.train.adapt
ADAPT_DIR`, started by serve/adapt/trainer_process.py) that trains head versions on the requests the server
captured. The server's half, and the workspace both read and write, is serve/adapt/.

    loop.py      the trainer's loop: a lock on the workspace, a round when enough is captured, stop on SIGTERM
    round.py     one round: train on captured and replay examples, judge, publish or refuse
    data.py      captured shards and replay examples, read and split by client
    gate.py      the held-out judgment of a new version against the live one
    groups.py    that judgment paired per client group
    review.py    the live version's rollback verdict
    publish.py   a version written into the workspace atomically
"""
