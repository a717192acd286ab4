"""The decoders over the engine: the step rules, the single-sequence decoder and its stream_generate
drop-ins, the batched generator, the draft-model method, activation and start-up.
"""
