import sys

from draft_node.server import main

sys.exit(main())
