import sys

from meshlm.cli import main

if __name__ == "__main__":  # not when a spawned process (data preparation) imports it
    sys.exit(main())
