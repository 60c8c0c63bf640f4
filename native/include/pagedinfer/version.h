#pragma once

namespace pagedinfer {
const char* version();
}  // namespace pagedinfer
