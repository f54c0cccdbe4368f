"""`python -m service.cli`: the `ringlab` console script."""

from service.cli.commands import main

if __name__ == "__main__":
    main()
