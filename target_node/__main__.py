import os
import sys

from common.ops.hugepages import reexec_with_huge_pages

reexec_with_huge_pages()
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # as client/cli/__init__.py says why

from target_node.server import main  # noqa: E402

sys.exit(main())
