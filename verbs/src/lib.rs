//! Placeholder until the verbs issue.
