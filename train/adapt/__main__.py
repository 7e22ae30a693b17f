"""`python -m draftsmith.train.adapt ADAPT_DIR`: the adaptation trainer (loop.py)."""

from .loop import main

if __name__ == "__main__":
    main()
