"""`python -m fivefold.train ...` / `torchrun --nproc-per-node N -m fivefold.train ...`.

The same flags as `fivefold train`; under torchrun each rank trains with the launcher's world.
"""

import sys

from fivefold.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
