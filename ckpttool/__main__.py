"""``python -m ckpttool``: the same command line as the ``ckpttool`` script."""

from ckpttool.cli import main

if __name__ == "__main__":
    main()
