import sys

from edgepath.cli import main

sys.exit(main())
