"""What dflash reads from any OpenAI-compatible server about the server itself (vLLM, SGLang, `transformers
serve`): its root URL, the model cards of `GET /v1/models`, and the model a job asks it for. Shared by the
jobs that talk to one (`dflash data regenerate`, `dflash eval --endpoint`), each refusing in one line."""

from __future__ import annotations

import json
from typing import Any

#: characters of a server's answer quoted in an error line
MAX_REASON = 200


#: answers of a server that is up but not ready yet (vLLM and SGLang open their port once the model is
#: loaded; a proxy or load balancer in front of one answers these meanwhile)
NOT_READY_STATUS = frozenset({502, 503, 504})


class ServerError(ValueError):
    """A server that cannot be used as asked; the message is one line naming it. `not_ready`: it may yet be
    (nothing listens yet, or it answers 502/503/504), so a job starting beside it can wait."""

    def __init__(self, message: str, not_ready: bool = False) -> None:
        super().__init__(message)
        self.not_ready = not_ready


def base_url(url: str) -> str:
    """The server's root: `http://h:8000`, `http://h:8000/` and `http://h:8000/v1` all name it."""
    return url.rstrip("/").removesuffix("/v1")


async def model_cards(client: Any, url: str) -> list[dict]:
    """The model cards a server lists (each with a string ``id``), through an httpx AsyncClient: one line
    when it does not answer, or answers as no OpenAI-compatible server does."""
    import httpx

    try:
        r = await client.get(f"{url}/v1/models")
    except (OSError, httpx.TransportError) as e:
        raise ServerError(f"{url}: unreachable ({type(e).__name__}: {e})", not_ready=True) from None
    try:
        cards = json.loads(r.content)["data"] if r.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        cards = None
    if not isinstance(cards, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
        text = " ".join(r.text.split())[:MAX_REASON]
        raise ServerError(f"{url}: not an OpenAI-compatible server (GET /v1/models answered HTTP {r.status_code}"
                          f"{': ' + text if text else ''})", not_ready=r.status_code in NOT_READY_STATUS)
    return cards


def chosen_model(names: list[str], model: str | None, url: str, flag: str) -> str:
    """``model`` when the server serves it, else (None) the server's only model; ``flag``: the option that
    names one."""
    if model is None:
        if len(names) != 1:
            raise ServerError(f"{url} serves {len(names)} models ({', '.join(names[:5]) or 'none'}): name one with "
                              f"{flag}")
        return names[0]
    if model not in names:
        raise ServerError(f"{url} does not serve model {model!r} (it serves: {', '.join(names[:5]) or 'none'})")
    return model
