"""The example model (a Qwen3-style decoder): manifest + checkpoint generator (its numpy oracle is tests/oracle.py)."""

from kerncc.example.config import QwenConfig, make_config
from kerncc.example.qwen import generate

__all__ = ["QwenConfig", "generate", "make_config"]
