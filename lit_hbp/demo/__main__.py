"""``python -m lit_hbp.demo``: the text demo (``lit_hbp.demo.text``)."""

import sys

from lit_hbp.demo.text import main

sys.exit(main())
