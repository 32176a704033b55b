"""Tokenization shared by the router and the engines: the HF ``tokenizers`` wrapper with the
chat template (:mod:`~services.tokenization.tokenizer`) and the incremental detokenization with
stop strings (:mod:`~services.tokenization.output_text`). Torch-free; below the engines and the
router in the layers, so both may import it and neither depends on the other's internals.
"""
