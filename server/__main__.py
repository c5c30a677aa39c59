"""`python -m specserve.server serve [MODEL] ...` — the same as the `specserve` console script."""
from specserve.server.cli import main

if __name__ == "__main__":
    main()
