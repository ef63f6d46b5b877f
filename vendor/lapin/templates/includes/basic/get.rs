/// Synchronously poll a single message from a queue.
///
/// Use the higher-level [`Channel::basic_get`] wrapper instead of calling
/// this method directly.
///
/// [`Channel::basic_get`]: crate::Channel::basic_get
