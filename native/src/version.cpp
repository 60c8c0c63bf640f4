#include "pagedinfer/version.h"

namespace pagedinfer {
const char* version() { return "0.1.0"; }
}  // namespace pagedinfer
