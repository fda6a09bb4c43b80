"""`python -m bench`: the benchmark suite (bench/suite.py; `make bench`)."""

import sys

from bench.suite import main

sys.exit(main())
