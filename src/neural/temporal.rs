//! Temporal stability of the neural stage (normalization statistics and output filter).
