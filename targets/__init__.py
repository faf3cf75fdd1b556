"""decompax.targets: the models being decomposed.

Pure forwards exposing the function table, their data, the deterministic
training of toy targets, the one record a run reads of any target
(`record.Target`), the decoder language models (`glu_*`) and the text LM
trainer's and the Brown corpus's pure parts. No file I/O. Imports `core`.
"""
