"""`python -m rollstore ...`: the same command line as the `rollstore` script."""

from rollstore.cli import main

if __name__ == "__main__":
    main()
