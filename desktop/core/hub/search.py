"""Search the Hugging Face Hub and read a repo's file list, through huggingface_hub's HfApi.

HF_ENDPOINT (mirrors, the test fake) and the token are read at call time, and Hub errors become
SwitchyardErrors that say what to do (accept a license, add a token, check the name).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from huggingface_hub import HfApi
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from desktop.core.common.errors import ModelError, SwitchyardError
from desktop.core.hub import cache
from desktop.core.hub.cache import hf_endpoint
from desktop.core.hub.tokens import get_token, redact
from desktop.core.hub.variants import (
    FitTagger,
    RemoteFile,
    VariantList,
    default_tagger,
    group_variants,
    quality_here,
)
from desktop.core.hub.variants import tag_and_recommend as _tag

FORMAT_FILTERS = {"gguf": "gguf", "safetensors": "safetensors", "awq": "awq", "gptq": "gptq", "fp8": "fp8"}
SORTS = {"downloads": "downloads", "recent": "last_modified", "likes": "likes", "trending": "trending_score"}

T = TypeVar("T")


class GatedModelError(SwitchyardError):
    """The repo needs an accepted license and a token."""


def gated_message(repo_id: str, has_token: bool) -> GatedModelError:
    url = f"{hf_endpoint()}/{repo_id}"
    if has_token:
        return GatedModelError(
            f"{repo_id} is gated and this token has no access to it.",
            f"accept the license at {url} with the account that owns the token, then retry",
        )
    return GatedModelError(
        f"{repo_id} is gated: accept the license at {url} and add a token.",
        "create a read token at https://huggingface.co/settings/tokens, then set HF_TOKEN or run "
        "`switchyard token set`",
    )


@contextmanager
def hub_errors(repo_id: str, revision: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub and network exceptions into one actionable line each."""
    token = get_token()
    try:
        yield
    except GatedRepoError:
        raise gated_message(repo_id, token is not None) from None
    except RevisionNotFoundError:
        raise ModelError(
            f"{repo_id} has no revision {revision!r}.", "use a branch, tag or commit that exists (default: main)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"No model repo {repo_id!r} on {hf_endpoint()} (or it is private).",
            "check the spelling (owner/name); for a private repo set HF_TOKEN",
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise gated_message(repo_id, token is not None) from None
        raise SwitchyardError(
            f"The Hub answered {status} for {repo_id}: {redact(str(exc).splitlines()[0], token)}",
            "retry later; set HF_ENDPOINT if you use a mirror",
        ) from None
    except OSError as exc:  # httpx errors are not OSError; caught below by name
        raise SwitchyardError(
            f"Cannot reach {hf_endpoint()}: {redact(str(exc), token)}", "check the network or HF_ENDPOINT"
        ) from None
    except Exception as exc:
        if type(exc).__module__.startswith(("httpx", "httpcore", "httpx2")):
            raise SwitchyardError(
                f"Cannot reach {hf_endpoint()}: {type(exc).__name__}: {redact(str(exc), token)}",
                "check the network or HF_ENDPOINT",
            ) from None
        raise


def make_api(token: str | None = None) -> HfApi:
    return HfApi(endpoint=hf_endpoint(), token=token or get_token() or False)


@dataclass
class SearchHit:
    repo_id: str
    author: str | None
    downloads: int
    likes: int
    last_modified: str | None
    gated: bool
    library: str | None
    formats: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def search(
    query: str,
    *,
    formats: list[str] | None = None,
    sort: str = "downloads",
    limit: int = 20,
    min_params: str | None = None,
    max_params: str | None = None,
    api: HfApi | None = None,
) -> list[SearchHit]:
    """Text search with format filters (gguf, safetensors, awq, gptq, fp8) and a parameter-count range ("7B")."""
    unknown = [f for f in formats or [] if f not in FORMAT_FILTERS]
    if unknown:
        raise SwitchyardError(f"Unknown format filter {unknown[0]!r}.", f"use one of {', '.join(FORMAT_FILTERS)}")
    if sort not in SORTS:
        raise SwitchyardError(f"Unknown sort {sort!r}.", f"use one of {', '.join(SORTS)}")
    num_parameters = ",".join(
        part for part in (f"min:{min_params}" if min_params else "", f"max:{max_params}" if max_params else "") if part
    )
    api = api or make_api()
    hits: list[SearchHit] = []
    with hub_errors(query):
        models = api.list_models(
            search=query or None,
            filter=[FORMAT_FILTERS[f] for f in formats or []] or None,
            sort=SORTS[sort],  # type: ignore[arg-type]
            limit=limit,
            num_parameters=num_parameters or None,
        )
        for m in models:
            tags = list(m.tags or [])
            lowered = {t.lower() for t in tags} | {str(m.library_name or "").lower()}
            hits.append(
                SearchHit(
                    repo_id=m.id,
                    author=m.author,
                    downloads=int(m.downloads or 0),
                    likes=int(m.likes or 0),
                    last_modified=m.last_modified.isoformat() if m.last_modified else None,
                    gated=bool(m.gated),
                    library=m.library_name,
                    formats=[f for f in FORMAT_FILTERS if f in lowered],
                    tags=tags,
                )
            )
    return hits


@dataclass
class RepoListing:
    repo_id: str
    commit: str
    gated: bool
    files: list[RemoteFile]
    config: dict[str, Any] | None
    tags: list[str]
    safetensors_params: dict[str, int] | None


def repo_listing(repo_id: str, revision: str | None = None, *, api: HfApi | None = None) -> RepoListing:
    """The repo's files at a revision with sizes, git oids and LFS sha256 (one model_info call)."""
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ModelError(f"{repo_id!r} is not a Hub repo id.", "write it as owner/name, e.g. Qwen/Qwen3-0.6B-GGUF")
    api = api or make_api()
    with hub_errors(repo_id, revision):
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    files = [
        RemoteFile(
            path=s.rfilename,
            size=int(s.size if s.size is not None else (s.lfs.size if s.lfs else 0)),
            blob_id=str(s.blob_id or ""),
            sha256=s.lfs.sha256 if s.lfs else None,
        )
        for s in info.siblings or []
    ]
    params = dict(info.safetensors.parameters) if info.safetensors else None
    # Names from the server become cache paths: refuse anything that is not what the Hub itself allows.
    cache.check_repo_id(str(info.id))
    cache.check_digest("commit", str(info.sha))
    for remote in files:
        cache.check_filename(remote.path)
        cache.check_digest("etag", remote.etag)
    return RepoListing(
        repo_id=info.id,
        commit=str(info.sha),
        gated=bool(info.gated),
        files=files,
        config=info.config if isinstance(info.config, dict) else None,
        tags=list(info.tags or []),
        safetensors_params=params,
    )


def list_variants(
    repo_id: str,
    revision: str | None = None,
    *,
    tagger: FitTagger | None = None,
    api: HfApi | None = None,
) -> VariantList:
    """The repo's variants, each tagged with the fit verdict for its engine, one marked recommended."""
    listing = repo_listing(repo_id, revision, api=api)
    variants, others = group_variants(
        listing.files, config=listing.config, tags=listing.tags, safetensors_params=listing.safetensors_params
    )
    measured, budget = quality_here(listing.repo_id)
    _tag(variants, tagger or default_tagger(), listing.config, measured, budget, listing.repo_id)
    return VariantList(listing.repo_id, listing.commit, listing.gated, variants, others)
