#include "pagedinfer/version.h"

#include <gtest/gtest.h>

#include <string>

TEST(Version, IsSet) { EXPECT_EQ(std::string(pagedinfer::version()), "0.1.0"); }
