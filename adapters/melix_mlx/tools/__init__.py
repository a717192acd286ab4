"""What measures and exercises the library rather than runs it: the benchmark, the qa kit's factories,
tiny and widened checkpoints, workloads and the conformance kit's reference.
"""
