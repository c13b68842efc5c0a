"""The example model (a Qwen3-style decoder): manifest + checkpoint generator.

Its independent numpy oracle is tests/oracle.py: only tests use it.
"""

from kerncc.example.config import QwenConfig, make_config
from kerncc.example.qwen import generate

__all__ = ["QwenConfig", "generate", "make_config"]
