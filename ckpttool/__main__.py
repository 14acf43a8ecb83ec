"""``python -m ckpttool``: the same command line as the ``ckpttool`` script."""

from ckpttool.cli import entry

if __name__ == "__main__":
    entry()
