"""kvl: a CPU-first, low-RAM inference runtime for moonshotai/Kimi-VL-A3B-Instruct."""

PINNED_REPO = "moonshotai/Kimi-VL-A3B-Instruct"
PINNED_REVISION = "398eede0903cd983a2bfa0cc634e9ac1d843f375"

__version__ = "0.1.0"
