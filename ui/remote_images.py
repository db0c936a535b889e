"""Remote images in chat text, shown as a note instead of fetched.

    withhold_remote_images('see ![cat](http://example.com/cat.png)')
    # 'see [image from example.com withheld]'

The page's Content-Security-Policy (ui/guard.py) already stops the browser from fetching another host;
this says so where the image would have been. Only what the chatbot displays is rewritten: the stored
message keeps its text.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

_URL = r"(?:[a-zA-Z][a-zA-Z0-9+.-]*:)?//[^\s)\"'>]+"  # http://..., https://..., //host/...
_MARKDOWN = re.compile(r"!\[[^\]]*\]\(\s*<?(" + _URL + r")>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_HTML = re.compile(r"<\s*(?:img|image|source|video|audio|picture|input)\b[^>]*?\b(?:src|srcset|poster)\s*=\s*"
                   r"[\"']?\s*(" + _URL + r")[^>]*>", re.IGNORECASE)


def _note(url: str) -> str:
    host = urlsplit(url if "//" in url else "//" + url).hostname or "another site"
    return f"[image from {host} withheld]"


def withhold_remote_images(text: str) -> str:
    if "//" not in text:
        return text
    text = _MARKDOWN.sub(lambda m: _note(m.group(1)), text)
    return _HTML.sub(lambda m: _note(m.group(1)), text)
