"""The page's panel when a remote server generates (`--backend URL`): what that engine tells about the latest
reply (prompt tokens, those its prefix cache held, time to first token, tokens/s), and, plainly, that the KV
cache and its statistics live on the server, so the local engine's panels and settings are not shown.

    remote_view(service.host)   # Markdown for the panel
"""

from __future__ import annotations

from chat_service.backend_client import TurnFigures

SAID_PLAINLY = ("The KV cache and its statistics (memory, fetched ratio, sparsity, time per step) live on the "
                "server, in its prefix cache (or LMCache): this app keeps the conversations, documents and search. "
                "InfiniGen's KV settings do not apply to a remote engine.")


def _count(value: int | None) -> str:
    return f"{value:,}" if value is not None else "not reported"


def figures_table(figures: TurnFigures) -> str:
    ttft = figures.time_to_first_token()
    rows = [("prompt tokens", _count(figures.prompt_tokens)),
            ("of those, held by the server's prefix cache", _count(figures.cached_tokens)),
            ("reply tokens", _count(figures.completion_tokens if figures.completion_tokens is not None
                                    else figures.pieces or None)),
            ("time to first token", f"{ttft:.2f} s" if ttft is not None else "no token yet"),
            ("tokens/s", f"{figures.tokens_per_second():.1f}")]
    return "| latest reply | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def remote_view(host) -> str:
    """Markdown for the remote engine's panel: the server and its model, the latest reply's figures."""
    figures = host.turn_figures()
    latest = figures_table(figures) if figures is not None and figures.started else "No reply from it yet."
    return f"**Remote engine:** {host.backend_line()}\n\n{latest}\n\n{SAID_PLAINLY}"  # the KV's place said once
