/* test_header_cpp.cpp: the public header compiles as C++11 (extern "C",
 * no C-only constructs outside macros) and links against the C library.
 * Deliberately nothing more: the API is tested from C elsewhere. */
#include "reflux.h"

#include <cstdio>
#include <cstring>

int main() {
    const char *v = rf_version();
    if (v == nullptr || std::strlen(v) == 0) {
        std::fprintf(stderr, "rf_version() returned nothing\n");
        return 1;
    }
    rf_dtype dt = RF_F32;
    rf_status st = RF_OK;
    (void)dt;
    (void)st;
    return 0;
}
