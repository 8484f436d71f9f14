"""Exception classes for csfmoe::Error kinds; the C++ message is kept as is."""


class Error(RuntimeError):
    """Base of every error raised by the csfmoe C++ library."""


class InvalidArgument(Error, ValueError):
    """A bad shape, dtype, size, device or option (csfmoe::InvalidArgument)."""


class Unsupported(Error, NotImplementedError):
    """A valid request this build or format does not handle."""


class FormatError(Error, ValueError):
    """Malformed or hostile file or encoded data."""


class CorruptData(Error):
    """Data decodes but fails its integrity check (CRC32)."""


class IoError(Error):
    """Operating-system level I/O failure."""


class CudaError(Error):
    """CUDA runtime or driver error."""


class FileMissing(FileNotFoundError, IoError):
    """A path the call reads does not exist: both FileNotFoundError and IoError."""


# In csfmoe::ErrorKind order.
ERROR_CLASSES = [InvalidArgument, Unsupported, FormatError, CorruptData, IoError, CudaError]
