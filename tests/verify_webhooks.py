"""Verifies fairlane's webhook calls with the Standard Webhooks reference
library (PyPI `standardwebhooks`), not with fairlane's own code.

Reads a JSON file: {"secret": "whsec_…", "calls": [{"headers": {…}, "body": "…"}]}
and exits non-zero, naming the call, if any signature does not verify or a
body is neither one event nor a batch of them.
"""

import json
import sys

from standardwebhooks.webhooks import Webhook


def main(path: str) -> int:
    with open(path, encoding="utf-8") as file:
        recorded = json.load(file)
    hook = Webhook(recorded["secret"])
    for index, call in enumerate(recorded["calls"]):
        try:
            payload = hook.verify(call["body"], call["headers"])
        except Exception as err:  # noqa: BLE001 - report any failure by call
            print(f"call {index} ({call['headers'].get('webhook-id')}): {err!r}")
            return 1
        # One event, or a batch of them (`max_events_per_call` above 1),
        # each with its own id.
        events = payload.get("events")
        if events is None:
            events = [payload]
        elif not events or any(event.get("id") is None for event in events):
            print(f"call {index}: a batch lacks events or their ids: {payload}")
            return 1
        for event in events:
            if event.get("type") is None or event.get("data") is None:
                print(f"call {index}: event lacks type or data: {event}")
                return 1
    print(f"{len(recorded['calls'])} calls verified")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
