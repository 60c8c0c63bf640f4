// Typed errors of the paged KV-cache core. Every public operation either succeeds or throws one
// of these before changing any state (strong exception guarantee).
#pragma once

#include <stdexcept>
#include <string>

namespace pagedinfer {

// Not enough free + evictable blocks for the request; the manager's state is unchanged.
class OutOfBlocksError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A sequence id that is not registered (also raised for a double free).
class UnknownSequenceError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// add_sequence / fork with an id that is already registered.
class DuplicateSequenceError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// check_invariants() found an inconsistent internal state (a bug, never user error).
class InvariantError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

}  // namespace pagedinfer
