package region

import (
	"fmt"
	"strings"
	"testing"
)

// TestCheckName: region names end up in metric labels, logs and holder IDs
// (region/NAME/NODE), so only short lowercase tokens pass; the error quotes the value and
// states the rule.
func TestCheckName(t *testing.T) {
	for _, ok := range []string{"eu", "r0", "eu-west-1", "us_east.2", "9", strings.Repeat("a", 63)} {
		if err := CheckName(ok); err != nil {
			t.Errorf("CheckName(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"bad name!", "EU", "-eu", ".eu", "eu/west", "eu west", "é", strings.Repeat("a", 64)} {
		err := CheckName(bad)
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%q", bad)) || !strings.Contains(err.Error(), "1 to 63 characters of a-z, 0-9") {
			t.Errorf("CheckName(%q) = %v, want it refused naming the value and the rule", bad, err)
		}
	}
	if err := CheckName(""); err == nil || !strings.Contains(err.Error(), "--region NAME") {
		t.Errorf("CheckName(\"\") = %v", err)
	}
}
