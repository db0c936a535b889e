"""Attached files as text for the model: convert a file once, then place it in any chat's prompt.

    from documents import convert_file, message_with_attachments
    document = convert_file(path)                       # raises DocumentError with a message for the user
    prompt = message_with_attachments("Summarise it.", [document])

Imports nothing from ui/ or sessions/, and no conversion library until a file needs one.
"""

from documents.convert import (
    MAX_NAME_CHARS,
    attachment_digest,
    attachment_name,
    convert_bytes,
    convert_file,
)
from documents.document import DOCUMENT_KINDS, Document, DocumentError, DocumentKind
from documents.limits import (
    DEFAULT_LIMITS,
    MAX_FILE_BYTES,
    MAX_TEXT_CHARS,
    MAX_UNZIPPED_BYTES,
    ConversionLimits,
)
from documents.prompt import (
    attachment_card,
    attachment_record,
    attachment_text,
    displayed_message,
    documents_of,
    message_with_attachments,
    question_of,
)

__all__ = [
    "DEFAULT_LIMITS", "DOCUMENT_KINDS", "MAX_FILE_BYTES", "MAX_NAME_CHARS", "MAX_TEXT_CHARS", "MAX_UNZIPPED_BYTES",
    "ConversionLimits", "Document", "DocumentError", "DocumentKind", "attachment_card", "attachment_digest",
    "attachment_name", "attachment_record", "attachment_text", "convert_bytes", "convert_file", "displayed_message", "documents_of", "message_with_attachments", "question_of",
]
