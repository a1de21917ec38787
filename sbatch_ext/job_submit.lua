--[[
job_submit.lua for sites without one of their own: the dsstage checks only.
Install next to slurm.conf with dsstage_submit.lua and the generated dsstage_catalog.lua,
and set JobSubmitPlugins=lua. Sites with their own job_submit.lua: see the header of
dsstage_submit.lua for the three lines to add.
]]

local here = string.match(debug.getinfo(1, "S").source, "^@(.*/)") or "/etc/slurm/"
package.path = here .. "?.lua;" .. package.path
local dsstage = require("dsstage_submit")
table.insert(dsstage.catalog_search, here .. "dsstage_catalog.lua")  -- a catalog kept next to slurm.conf

function slurm_job_submit(job_desc, part_list, submit_uid)
	local rc, msg = dsstage.check(job_desc, submit_uid)
	if rc ~= slurm.SUCCESS then
		slurm.log_user(msg)
	end
	return rc
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	return slurm.SUCCESS
end

return slurm.SUCCESS
