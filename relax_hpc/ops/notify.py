"""Notifications of a run's life through Apprise (Slack, e-mail, ntfy, a JSON webhook, ... one URL each).

Where the URLs come from: the recipe's ``logging.notify_urls`` and the environment variable
``RELAX_NOTIFY_URLS`` (whitespace- or comma-separated). The recipe's URLs are secrets (they carry the service's
password or token): the run directory's copy of the recipe holds them masked, the controller gets them from the run's
secrets file (:mod:`relax_hpc.rundir`, "the recipe's secrets").
Delivery must never cost the run anything: each send runs in a daemon thread the caller waits on for at
most ``timeout_s``, and a failure is logged (by URL scheme only: URLs carry tokens) and forgotten.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Mapping

log = logging.getLogger("relax_hpc.notify")

EVENTS = ("started", "checkpoint", "preempted", "requeued", "resumed", "step_restarted", "failed", "finished",
          "cancelled", "scale", "scale_done", "engine_gone")
ENV = "RELAX_NOTIFY_URLS"
HELP = "https://github.com/caronc/apprise/wiki"


def notify_urls(recipe_urls: list[str] | None, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The recipe's URLs, then those of ``RELAX_NOTIFY_URLS``; duplicates dropped, order kept."""
    urls = list(recipe_urls or []) + [u for u in re.split(r"[\s,]+", environ.get(ENV, "")) if u]
    return list(dict.fromkeys(urls))


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] + "://..." if "://" in url else "(no scheme)"


class Notifier:
    """Sends a run's events to its URLs. The controller calls ``send`` from its main loop, so a slow or dead
    service may cost it at most ``timeout_s`` and never an exception."""

    def __init__(self, urls: list[str], run_name: str, timeout_s: float = 10.0):
        self.urls, self.run_name, self.timeout_s = list(urls), run_name, timeout_s

    def send(self, event: str, body: str, level: str = "info") -> bool:
        """Notify every URL of ``event``; True if all deliveries succeeded in time. Never raises for delivery."""
        if event not in EVENTS:
            raise ValueError(f"unknown notification event {event!r}; known: {', '.join(EVENTS)}")
        if not self.urls:
            return False
        import apprise

        kind = {"info": apprise.NotifyType.INFO, "success": apprise.NotifyType.SUCCESS,
                "warning": apprise.NotifyType.WARNING, "failure": apprise.NotifyType.FAILURE}.get(level)
        if kind is None:
            raise ValueError(f"unknown notification level {level!r}; known: info, success, warning, failure")
        title = f"relax_hpc run {self.run_name}: {event}"
        text = f"run {self.run_name}: {event}" + (f"\n{body}" if body else "")
        ok = {}

        def deliver() -> None:
            for url in self.urls:
                try:
                    a = apprise.Apprise()
                    ok[url] = a.add(url) and bool(a.notify(body=text, title=title, notify_type=kind))
                except Exception:  # a plugin's bug must not reach the controller
                    ok[url] = False

        t = threading.Thread(target=deliver, name="relax-notify", daemon=True)
        t.start()
        t.join(self.timeout_s)
        failed = [u for u in self.urls if not ok.get(u)]
        for u in failed:
            log.warning("notification %r to %s was not delivered%s", event, _scheme(u),
                        "" if u in ok else f" within {self.timeout_s:g} s")
        return not failed

    @staticmethod
    def check(urls: list[str]) -> list[str]:
        """Errors for URLs Apprise cannot parse (recipe validation); each names the key, the scheme and the fix."""
        import apprise

        from relax_hpc.rundir import is_masked

        errors = []
        for i, url in enumerate(urls):
            if is_masked(url):  # the run directory's copy: the URL itself is in the run's secrets file
                continue
            if not apprise.Apprise().add(url):
                errors.append(f"logging.notify_urls[{i}] = {_scheme(url)} is not a URL Apprise understands. "
                              f"Fix: see {HELP} for the URL of your service")
        return errors
