"""``ridgeline why REQUEST_ID``: one served request's story in plain words with its numbers:
queued (and whether the KV cache was full), its own prefill, its decode, the time other
requests added to it and who they were, its preemptions."""
from __future__ import annotations

import json

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    from ridgeline.agent.subscriber import add_stream_arguments
    p = sub.add_parser("why", help="one request's story: slow on its own, or dragged by others?",
                       description=description(__doc__))
    p.add_argument("request_id", metavar="REQUEST_ID", help="the engine's request id (vLLM gen_ai.request.id, "
                                                            "SGLang rid)")
    add_stream_arguments(p, topics=False)
    p.add_argument("--input", metavar="FILE", help="look it up in FILE, an output of `ridgeline requests --json`, "
                                                   "instead of waiting for it on the agent's stream")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="wait at most S seconds for the request to be told on the stream, exit 1 "
                        "(default: %(default)s)")
    p.add_argument("--json", action="store_true", help="the story as JSON")
    p.set_defaults(func=run, windows=0)


def run(args) -> int:
    import msgspec

    from ridgeline.agent import request_view
    from ridgeline.aggregator.request_join import story_text
    if not args.request_id or len(args.request_id) > 256:
        raise InputError("REQUEST_ID must be 1..256 characters")
    if args.input:
        stories = request_view.load_json(args.input)
        found = [s for s in stories if s.request_id == args.request_id]
        if not found:
            raise RuntimeFailure(f"why: request {args.request_id!r} is not in {args.input} "
                                 f"({len(stories)} request(s) there)")
    else:
        if not args.timeout > 0:
            raise InputError("--timeout must be > 0")
        from .requests import collect
        stories, _ = collect(args, want_id=args.request_id)
        found = [s for s in stories if s.request_id == args.request_id]
    story = found[-1]
    print(json.dumps(msgspec.to_builtins(story), indent=1) if args.json
          else story_text(request_view.printable(story)))
    return 0
