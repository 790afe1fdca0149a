"""Model hub: search the Hugging Face Hub, list a repo's variants with fit tags, download into the HF cache,
and manage the models on disk. Qt-free; progress is plain callbacks carrying dataclasses."""

from desktop.core.hub.download import (
    ChecksumMismatch,
    DiskFull,
    DownloadCancelled,
    DownloadControl,
    DownloadProgress,
    FileProgress,
    PullResult,
    RetryPolicy,
    pull,
)
from desktop.core.hub.library import DeleteResult, LocalModel, add_path, delete, list_local
from desktop.core.hub.search import GatedModelError, SearchHit, list_variants, search
from desktop.core.hub.variants import FitTagger, Variant, VariantList

__all__ = [
    "ChecksumMismatch",
    "DeleteResult",
    "DiskFull",
    "DownloadCancelled",
    "DownloadControl",
    "DownloadProgress",
    "FileProgress",
    "FitTagger",
    "GatedModelError",
    "LocalModel",
    "PullResult",
    "RetryPolicy",
    "SearchHit",
    "Variant",
    "VariantList",
    "add_path",
    "delete",
    "list_local",
    "list_variants",
    "pull",
    "search",
]
