"""One place in the run's storage, on pyarrow's filesystems: a local path (on a shared
filesystem too) or a URI pyarrow resolves (``s3://``, ``gs://``, ``hdfs://``, ...).

S3 endpoints and credentials come only from the standard AWS variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), which pyarrow reads itself. A URI that
carries credentials (``s3://KEY:SECRET@bucket``) is refused, and shown only redacted: a URI
ends up in messages, logs, configs and summaries that others read. The config holds the
same rule for every key of it (``config.base.refuse_credentials``).

A file written here gets the mode a plain ``open()`` gets under the user's umask, so that a
team sharing a cache or a run directory reads each other's files as the umask allows.

What a bucket holds is data, not a promise: a key is materialised locally only if every
part of it is a plain name, so no key can write outside the folder it is downloaded to.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_app.errors import BadInputError, first_line

# A scheme of two or more letters, so that a Windows drive (C:\runs) stays a path.
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")


# The userinfo of a URI anywhere in a text: ``user[:password]@`` before the host, or a
# password holding a '/' (AWS secret keys often do), which ends the host part early: then
# ':' is followed by something other than a port number.
_CREDENTIALS = re.compile(
    r"\b(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+://)"
    r"(?P<userinfo>[^\s/?#@'\"]*@"
    r"|[^\s/?#@:'\"]*:(?![0-9]*(?:[/?#\s'\"]|$))[^\s@'\"]*@)"
)


def is_uri(text: str | os.PathLike) -> bool:
    """Whether ``text`` names a filesystem by URI (``s3://bucket/x``), not a local path."""
    return uri_scheme(text) is not None


def uri_scheme(text: str | os.PathLike) -> str | None:
    """The scheme of a URI, lower case (``s3``), or None for a local path."""
    match = _URI.match(os.fspath(text))
    return match[1].lower() if match else None


def has_credentials(text: str | os.PathLike) -> bool:
    """Whether ``text`` holds a URI with credentials in it (``s3://KEY:SECRET@bucket``)."""
    return bool(_CREDENTIALS.search(os.fspath(text)))


def redact_credentials(text: str) -> str:
    """``text`` with the credentials of every URI in it replaced by ``***``."""
    return _CREDENTIALS.sub(r"\g<scheme>***@", text)


# Where each kind of URI's credentials come from instead: the variables its client reads.
_CREDENTIAL_VARIABLES = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS",
    "postgresql": "PGUSER and PGPASSWORD",  # an MLflow database; libpq reads them
    "postgres": "PGUSER and PGPASSWORD",
    "hdfs": "HADOOP_USER_NAME",
    "viewfs": "HADOOP_USER_NAME",
}


def credentials_advice(text: str, variables: str | None = None) -> str:
    """Why a URI with credentials is refused and where they go instead: ``variables``, or
    those that the client of the URI's scheme reads."""
    scheme = (uri_scheme(text) or "").split("+")[0]  # postgresql+psycopg2://
    variables = variables or _CREDENTIAL_VARIABLES.get(scheme)
    instead = (
        f"set {variables} in the environment instead"
        if variables
        else "let the code using it read them from the environment instead"
    )
    return (
        "the URI carries credentials, which config.yaml, checkpoints, logs and messages "
        f"would show; give it without them and {instead}"
    )


def _credentials_error(text: str, key: str) -> BadInputError:
    return BadInputError(f"{key}={redact_credentials(text)!r}: {credentials_advice(text)}")


def _bad_uri(text: str, key: str, reason: str) -> BadInputError:
    # pyarrow's own message may quote the URI: redact both
    text, reason = redact_credentials(text), redact_credentials(reason)
    return BadInputError(
        f"{key}={text!r} is not a storage location pyarrow can open ({reason}); use a local "
        f"path or a URI such as s3://bucket/prefix, gs://bucket/prefix or hdfs://host/path "
        f"(S3 endpoint and credentials come from the AWS_* environment variables)"
    )


@dataclass(frozen=True)
class StorageLocation:
    """A file or directory in some filesystem.

    Attributes:
        filesystem: the pyarrow filesystem that holds it.
        path: its path inside ``filesystem`` (``bucket/prefix`` on S3).
        uri: what users see and pass back: the local path, or the URI.
    """

    filesystem: pafs.FileSystem
    path: str
    uri: str

    @classmethod
    def parse(cls, text: str | os.PathLike, key: str) -> StorageLocation:
        """A local path (``~`` expanded, made absolute) or a filesystem URI.

        Args:
            text: the path or URI.
            key: the config key or flag it came from, named in errors.

        Raises:
            BadInputError: a URI of an unknown scheme, one pyarrow cannot resolve, or one
                with credentials in it.
        """
        text = os.fspath(text)
        if not is_uri(text):
            return cls.local(Path(text).expanduser().absolute())
        if has_credentials(text):
            raise _credentials_error(text, key)
        try:
            filesystem, path = pafs.FileSystem.from_uri(text)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _bad_uri(text, key, first_line(exc)) from None
        if not path.strip("/"):
            raise _bad_uri(text, key, "it names no bucket or path")
        if isinstance(filesystem, pafs.LocalFileSystem):  # file:///...
            return cls.local(Path(path))
        return cls(filesystem, path.rstrip("/"), text.rstrip("/"))

    @classmethod
    def local(cls, path: Path) -> StorageLocation:
        """A local path (absolute), as is."""
        return cls(pafs.LocalFileSystem(), str(path), str(path))

    def __str__(self) -> str:
        return self.uri

    @property
    def is_local(self) -> bool:
        """On this machine's filesystem (which may be a shared one every node mounts)."""
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    @property
    def local_path(self) -> Path:
        """The local path of a local location.

        Raises:
            ValueError: the location is in an object store or another remote filesystem.
        """
        if not self.is_local:
            raise ValueError(f"'{self.uri}' is not a local path")
        return Path(self.path)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def child(self, *parts: str) -> StorageLocation:
        """The location ``parts`` below this one (``child("checkpoints", "x")``).

        Raises:
            BadInputError: a part is ``.`` or ``..`` (a key in a bucket may say so), which
                would name a place that is not below this one.
        """
        for part in parts:
            _check_names(self.uri, part, [name for name in part.split("/") if name])
        if self.is_local:
            return StorageLocation.local(Path(self.path, *parts))
        suffix = "/".join(p.strip("/") for p in parts)
        scheme, netloc, path, query, fragment = urlsplit(self.uri)
        uri = urlunsplit((scheme, netloc, f"{path.rstrip('/')}/{suffix}", query, fragment))
        return StorageLocation(self.filesystem, f"{self.path}/{suffix}", uri)

    @property
    def parent(self) -> StorageLocation:
        """The folder that holds this location."""
        if self.is_local:
            return StorageLocation.local(Path(self.path).parent)
        scheme, netloc, path, query, fragment = urlsplit(self.uri)
        uri = urlunsplit((scheme, netloc, path.rsplit("/", 1)[0], query, fragment))
        return StorageLocation(self.filesystem, self.path.rsplit("/", 1)[0], uri)

    def at(self, path: str) -> StorageLocation:
        """The location of ``path``, a path in this filesystem at or below this location
        (one that Ray or a listing returned)."""
        inner = path.rstrip("/")
        if inner == self.path:
            return self
        if not inner.startswith(f"{self.path}/"):
            raise ValueError(f"'{path}' is not inside '{self.path}'")
        relative = inner[len(self.path) + 1 :]
        _check_names(self.uri, path, relative.split("/"))
        return self.child(relative)

    # Queries

    def _type(self) -> pafs.FileType:
        return self.filesystem.get_file_info(self.path).type

    def exists(self) -> bool:
        return self._type() != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self._type() == pafs.FileType.File

    def is_dir(self) -> bool:
        return self._type() == pafs.FileType.Directory

    def list_dir(self, recursive: bool = False, files_only: bool = False) -> list[StorageLocation]:
        """What this directory holds (every depth with ``recursive``; only files with
        ``files_only``), sorted; [] when it does not exist."""
        selector = pafs.FileSelector(self.path, allow_not_found=True, recursive=recursive)
        infos = self.filesystem.get_file_info(selector)
        if files_only:
            infos = [info for info in infos if info.type == pafs.FileType.File]
        return [self.at(info.path) for info in sorted(infos, key=lambda info: info.path)]

    # Reading and writing

    def read_bytes(self) -> bytes:
        with self.filesystem.open_input_stream(self.path) as stream:
            return stream.read()

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def write_bytes(self, data: bytes) -> None:
        """Write the whole file at once: readers see the old file or the new one, never a
        part (locally a temporary file then ``os.replace``; an object-store put is atomic)."""
        if not self.is_local:
            with self.filesystem.open_output_stream(self.path) as stream:
                stream.write(data)
            return
        target = self.local_path
        fd, tmp = temporary_file(target)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, target)
        except PermissionError:  # the folder lets us create a file, not replace another's
            tmp.unlink(missing_ok=True)
            raise _not_writable(target) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    def upload(self, source: Path) -> None:
        """Copy the local file or directory ``source`` (its contents) to this location."""
        try:
            if self.is_local:
                self.local_path.parent.mkdir(parents=True, exist_ok=True)
            pafs.copy_files(
                str(source),
                self.path,
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=self.filesystem,
            )
        except PermissionError:
            if not self.is_local:  # a store's refusal: its own message says why
                raise
            raise _not_writable(self.local_path) from None

    def download(self, directory: Path) -> Path:
        """Copy this file, or this directory's contents, into the local ``directory``.

        Every file's key is checked before anything is written: one whose parts are not
        all plain names (``..``, ``.``, an empty part) is refused, so nothing lands outside
        ``directory``.

        Returns:
            The local copy: ``directory / name`` for a file, ``directory`` for a directory.

        Raises:
            BadInputError: a key below this location is not a plain relative path.
        """
        if self.is_file():
            _check_names(self.uri, self.name, [self.name])
            copies = [(self.path, directory / self.name)]
            target = directory / self.name
        else:
            copies = [(path, directory.joinpath(*parts)) for path, parts in self._files()]
            target = directory
        directory.mkdir(parents=True, exist_ok=True)
        for source, local in copies:
            local.parent.mkdir(parents=True, exist_ok=True)
            pafs.copy_files(
                source,
                str(local),
                source_filesystem=self.filesystem,
                destination_filesystem=pafs.LocalFileSystem(),
            )
        return target

    def _files(self) -> list[tuple[str, list[str]]]:
        """Every file below this directory: its path and its checked parts below it."""
        selector = pafs.FileSelector(self.path, allow_not_found=True, recursive=True)
        prefix = f"{self.path.rstrip('/')}/"
        files = []
        for info in self.filesystem.get_file_info(selector):
            if info.type != pafs.FileType.File:
                continue
            relative = info.path[len(prefix) :] if info.path.startswith(prefix) else ""
            parts = relative.split("/")
            _check_names(self.uri, info.path, parts)
            files.append((info.path, parts))
        return sorted(files)

    def delete(self) -> None:
        """Delete this file or directory (with everything under it); nothing if absent."""
        kind = self._type()
        if kind == pafs.FileType.Directory:
            self.filesystem.delete_dir(self.path)
        elif kind != pafs.FileType.NotFound:
            self.filesystem.delete_file(self.path)


def temporary_file(target: Path) -> tuple[int, Path]:
    """A new, empty file beside ``target`` (its folder made if missing), open for writing,
    to be renamed onto ``target``: ``tempfile.mkstemp`` without its fixed 0600 mode.

    The file gets what a plain ``open()`` would give it (0666 less the umask, and a
    folder's default ACL), so a team sharing the folder reads it when the user's umask
    says so; the user's umask 077 still keeps it to themselves.

    Returns:
        The open file descriptor and the file's path.

    Raises:
        BadInputError: this user may not create files in that folder.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC  # O_EXCL: never via a link
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        while True:
            tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
            try:
                return os.open(tmp, flags, 0o666), tmp
            except FileExistsError:  # another writer's temporary file, by a 2**-48 chance
                continue
    except PermissionError:
        raise _not_writable(target) from None


def _not_writable(target: Path) -> BadInputError:
    """A write refused by the filesystem's permissions, naming the folder that refused it
    (the nearest that exists) and the way out."""
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return BadInputError(
        f"cannot write {target}: this user (uid {os.geteuid()}) may not write in {folder}; "
        f"give it write access there (a folder a team shares: a common group, chmod g+ws, "
        f"and umask 002) or point the run at a folder it can write"
    )


def _check_names(uri: str, key: str, parts: list[str]) -> None:
    """Refuse a key below ``uri`` unless its ``parts`` are plain names: ``..`` leaves the
    folder a key is copied to, and ``.`` or an empty part makes two keys one file."""
    if all(part not in ("", ".", "..") for part in parts):
        return
    raise BadInputError(
        f"{redact_credentials(uri)} holds the key {key!r}, which does not name a place inside "
        f"it ('..', '.' or an empty part), so raytrain reads or downloads nothing of it; "
        f"remove or rename that object in the store"
    )
