#!/usr/bin/env python3
"""Check a parallel layout against the golden model: see megatron_k3/parallel/verify.py (or --help)."""


from megatron_k3.parallel.verify import main  # noqa: E402

if __name__ == "__main__":
    main()
