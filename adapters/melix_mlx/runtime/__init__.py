"""The speculative cycle's machinery: the engine, rollback, recurrent-state capture, KV caches,
sampling and acceptance, calibration and rank agreement.
"""
