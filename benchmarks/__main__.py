"""``python -m benchmarks``: see ``benchmarks.cli`` and benchmarks/README.md."""

from benchmarks.cli import main

if __name__ == "__main__":
    main()
