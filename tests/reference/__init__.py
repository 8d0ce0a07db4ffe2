"""Independent FP32 PyTorch reference for Kimi-VL (the test oracle).

Owns: a from-the-spec re-implementation of checkpoint loading, the text decoder (naive MLA),
MoonViT + projector, image preprocessing, the tokenizer and prompt assembly. It shares no code with
the kvl/ package on purpose: a bug copied into both sides would make the comparison meaningless.
Does not own: anything the runtime ships; nothing here is imported by kvl/.
"""
