"""Online adaptation, the server's half (draftsmith-serve adapt=true): requests captured, head versions swapped in
between requests, rolled back on the trainer's verdict. The trainer's half, which trains those versions in a
process beside the server, is train/adapt/."""
