import sys

from common.ops.hugepages import reexec_with_huge_pages

reexec_with_huge_pages()

from target_node.server import main  # noqa: E402

sys.exit(main())
