package region

import (
	"fmt"
	"regexp"
)

// nameRE is the rule for a region's name: it goes into metric labels, log fields and the
// holder's client ID at the global cluster (region/NAME/NODE), so it is a short lowercase
// token without separators or spaces.
var nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

// CheckName reports why name cannot name a region (--region), or nil.
func CheckName(name string) error {
	if name == "" {
		return fmt.Errorf("region: no region name; give --region NAME")
	}
	if !nameRE.MatchString(name) {
		return fmt.Errorf("region name %q is not allowed: use 1 to 63 characters of a-z, 0-9, '-', '_' and '.', starting with a letter or digit (e.g. eu-west-1)", name)
	}
	return nil
}
