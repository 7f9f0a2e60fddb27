"""Where a run's files live: a local path, a shared filesystem or an object-store URI."""

from raytrain_app.storage.location import StorageLocation, is_uri, uri_scheme
from raytrain_app.storage.staging import StagingDirectory

__all__ = ["StagingDirectory", "StorageLocation", "is_uri", "uri_scheme"]
