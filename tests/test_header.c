/* test_header.c: the public header is self-contained plain C99.
 *
 * Built with -std=c99 -pedantic (see CMakeLists.txt), it includes only
 * reflux.h and checks that the library's version matches the header's. It
 * deliberately uses nothing else: the API itself is tested elsewhere.
 */
#include "reflux.h"

#include <stdio.h>
#include <string.h>

int main(void) {
    char expected[64];
    const char *v = rf_version();
    snprintf(expected, sizeof expected, "%d.%d.%d", RF_VERSION_MAJOR, RF_VERSION_MINOR,
             RF_VERSION_PATCH);
    if (v == NULL || strcmp(v, expected) != 0) {
        fprintf(stderr, "rf_version() = \"%s\", header says \"%s\"\n", v ? v : "(null)", expected);
        return 1;
    }
    printf("reflux %s\n", v);
    return 0;
}
