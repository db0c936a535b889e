"""Command-line flags of `python app.py`, validated before anything heavy starts."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from infinigen_core.model_flags import add_model_flags

from .client_slots import DEFAULT_REQUESTS_PER_CLIENT
from .key_file import KeyFileError, exposed_key_warning, read_key_file

API_KEY_VARIABLE = "INFINIGEN_API_KEY"
BACKEND_KEY_VARIABLE = "INFINIGEN_BACKEND_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python app.py", description="InfiniGen Chat: a local long-context chat app")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where sessions are stored (default: $INFINIGEN_DATA_DIR or ~/.local/share/infinigen-chat)")
    add_model_flags(parser)
    parser.add_argument("--share", action="store_true", help="also create a public Gradio share link (off by default)")
    parser.add_argument("--no-api", dest="api", action="store_false",
                        help="do not serve the OpenAI-compatible API (/v1/models, /v1/chat/completions)")
    api_key = parser.add_mutually_exclusive_group()
    api_key.add_argument("--api-key", default=None,
                         help=f"a key every API request must send as 'Authorization: Bearer KEY', and the page's login "
                              f"password (any user name) (default: ${API_KEY_VARIABLE}; required with a --host "
                              f"other than loopback or --share). Every user of the machine can read a command line: "
                              f"prefer --api-key-file or ${API_KEY_VARIABLE}")
    api_key.add_argument("--api-key-file", type=Path, metavar="PATH", default=None,
                         help="read the key from this file (the key alone, on one line; make it readable by you "
                              "only, chmod 600)")
    parser.add_argument("--api-max-waiting", type=int, default=4,
                        help="API requests that may wait for their turn; one more gets 429 (default 4)")
    parser.add_argument("--max-requests-per-client", type=int, default=DEFAULT_REQUESTS_PER_CLIENT, metavar="N",
                        help=f"POSTs to the API and uploads one client address may have in flight at once; one "
                             f"more gets 429 (default {DEFAULT_REQUESTS_PER_CLIENT}; 0: no cap). Every program on "
                             f"this machine counts as one client")
    parser.add_argument("--kv-disk-limit", metavar="SIZE", default=None,
                        help="disk space all sessions' saved KV caches may take, e.g. 20GiB; over it the least recently "
                             "used sessions' KV is dropped (their text stays). Default: a quarter of the free space")
    parser.add_argument("--kv-format", choices=("int8", "exact"), default="int8",
                        help="how KV caches are saved: int8 (default, 4x smaller) or exact (bit for bit)")
    parser.add_argument("--backend", metavar="URL", default=None,
                        help="generate replies on an OpenAI-compatible server (vLLM, llama.cpp's server, another "
                             "instance of this app) at its base URL, e.g. http://gpu-box:8000/v1; sessions, documents, "
                             "search, the page and this app's own /v1 stay here. No model is loaded here")
    backend_key = parser.add_mutually_exclusive_group()
    backend_key.add_argument("--backend-key", default=None,
                             help=f"the key the backend wants as 'Authorization: Bearer KEY' (default: "
                                  f"${BACKEND_KEY_VARIABLE}; prefer --backend-key-file or the variable: every user "
                                  f"of the machine can read a command line)")
    backend_key.add_argument("--backend-key-file", type=Path, metavar="PATH", default=None,
                             help="read the backend's key from this file (the key alone, on one line)")
    parser.add_argument("--backend-model", default=None,
                        help="the backend's model to ask for (default: the first one its /v1/models lists)")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_requests_per_client < 0:
        parser.error(f"--max-requests-per-client must be 0 (no cap) or more, got {args.max_requests_per_client}")
    if args.api_max_waiting < 0:
        parser.error(f"--api-max-waiting must be 0 or more, got {args.api_max_waiting}")
    args.api_key = _key(parser, args.api_key, args.api_key_file, "--api-key", API_KEY_VARIABLE)
    args.backend_key = _key(parser, args.backend_key, args.backend_key_file, "--backend-key", BACKEND_KEY_VARIABLE)
    exposed = args.share or not is_loopback(args.host)
    if exposed and args.api_key is None:  # the page alone (--no-api) is as open as the API: both need the key
        where = "a public --share link" if args.share else f"--host {args.host}"
        served = "the chat page and the API" if args.api else "the chat page (--no-api turns off only the API)"
        parser.error(f"with {where}, {served} would answer anyone who can reach it: give --api-key-file PATH "
                     f"(or set {API_KEY_VARIABLE}), the page's login password and the API's key, or listen on "
                     f"loopback only (--host 127.0.0.1, without --share)")
    from sessions.storage import StorageConfig, parse_size

    try:
        limit = parse_size(args.kv_disk_limit) if args.kv_disk_limit is not None else None
    except ValueError as error:
        parser.error(f"--kv-disk-limit: {error}")
    args.storage = StorageConfig(kv_format=args.kv_format, kv_disk_limit=limit)
    args.backend_config = _backend_config(parser, args)
    return args


def _key(parser: argparse.ArgumentParser, given: str | None, file: Path | None, flag: str,
         variable: str) -> str | None:
    """A key from the command line (with a warning: others can read it there), from its file, or from the
    environment variable; None without any."""
    if given is not None:
        if not given.strip():
            parser.error(f"{flag} is empty: give a key, or leave the flag out")
        print(exposed_key_warning(flag, f"{flag}-file", variable), file=sys.stderr)
        return given
    if file is not None:
        try:
            return read_key_file(file, f"{flag}-file")
        except KeyFileError as error:
            parser.error(str(error))
    from_environment = os.environ.get(variable)
    if from_environment and not from_environment.strip():
        parser.error(f"${variable} is blank: give a key, or unset it")
    return from_environment or None


def _backend_config(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The remote backend's settings, checked (None without --backend)."""
    if args.backend is None:
        if args.backend_model is not None:
            parser.error("--backend-model needs --backend URL")
        return None
    if args.model is not None:
        parser.error("--model and --backend exclude each other: the backend serves its own model "
                     "(pick one of its models with --backend-model)")
    from chat_service.backend_client import BackendConfig

    try:
        return BackendConfig(args.backend, args.backend_key, args.backend_model)
    except ValueError as error:
        parser.error(f"--backend: {error}")
