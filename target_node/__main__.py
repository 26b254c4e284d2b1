import sys

from target_node.server import main

sys.exit(main())
