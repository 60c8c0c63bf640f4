#include "pagedinfer/prefix_cache.h"

#include <cassert>

namespace pagedinfer {
namespace {

// splitmix64's finaliser: a cheap full-avalanche 64-bit mix.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

}  // namespace

uint64_t chain_hash(uint64_t parent_hash, const int32_t* tokens, int32_t num_tokens) {
  // Each step (rotate, xor a pair of tokens, multiply by an odd constant) is a bijection of the
  // state, so blocks that differ in one token pair never collide at that step; one full mix at
  // the end spreads the result over the index bits. Lookups verify content, so this only has
  // to be fast and well spread, not cryptographic.
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ULL;
  uint64_t h = mix64(parent_hash) ^ static_cast<uint64_t>(num_tokens);
  int32_t i = 0;
  for (; i + 1 < num_tokens; i += 2) {
    uint64_t pair = static_cast<uint32_t>(tokens[i]) |
                    (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h = (((h << 23) | (h >> 41)) ^ pair) * kMul;
  }
  if (i < num_tokens) h = (((h << 23) | (h >> 41)) ^ static_cast<uint32_t>(tokens[i])) * kMul;
  return mix64(h);
}

PrefixCache::PrefixCache(int32_t num_blocks)
    : hash_(num_blocks, 0),
      parent_(num_blocks, -1),
      parent_generation_(num_blocks, 0),
      generation_(num_blocks, 0),
      registered_(num_blocks, 0) {
  std::size_t capacity = 8;
  while (capacity < 2 * static_cast<std::size_t>(num_blocks)) capacity *= 2;  // load factor <= 1/2
  table_.assign(capacity, Entry{0, -1});
  mask_ = capacity - 1;
}

int32_t PrefixCache::find(uint64_t hash) const {
  for (std::size_t slot = slot_of(hash);; slot = (slot + 1) & mask_) {
    const Entry& entry = table_[slot];
    if (entry.block < 0 || entry.hash == hash) return entry.block;
  }
}

bool PrefixCache::is_child_of(int32_t block, int32_t parent) const {
  if (parent_[block] != parent) return false;
  return parent < 0 || (registered_[parent] && generation_[parent] == parent_generation_[block]);
}

bool PrefixCache::has_valid_parent(int32_t block) const {
  return is_child_of(block, parent_[block]);
}

void PrefixCache::insert(int32_t block, uint64_t hash, int32_t parent) {
  assert(!registered_[block] && find(hash) < 0);
  std::size_t slot = slot_of(hash);
  while (table_[slot].block >= 0) slot = (slot + 1) & mask_;
  table_[slot] = Entry{hash, block};
  hash_[block] = hash;
  parent_[block] = parent;
  parent_generation_[block] = parent >= 0 ? generation_[parent] : 0;
  generation_[block] = next_generation_++;
  registered_[block] = 1;
  ++size_;
}

void PrefixCache::erase(int32_t block) {
  assert(registered_[block]);
  std::size_t slot = slot_of(hash_[block]);
  while (table_[slot].block != block) slot = (slot + 1) & mask_;
  // Backward-shift deletion keeps every probe chain unbroken without tombstones.
  std::size_t hole = slot;
  for (std::size_t next = (hole + 1) & mask_; table_[next].block >= 0; next = (next + 1) & mask_) {
    std::size_t home = slot_of(table_[next].hash);
    // Move the entry into the hole unless its home lies cyclically in (hole, next].
    bool stays = hole <= next ? (hole < home && home <= next) : (hole < home || home <= next);
    if (!stays) {
      table_[hole] = table_[next];
      hole = next;
    }
  }
  table_[hole] = Entry{0, -1};
  registered_[block] = 0;
  --size_;
}

}  // namespace pagedinfer
